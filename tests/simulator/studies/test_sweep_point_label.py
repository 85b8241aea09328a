"""A refused sweep point is named as the user wrote it: a null value as ``null``."""

from simulator.studies.sweep_check import point_label


def test_null_named_null():
    assert point_label({"training": None, "training.micro_batch_size": 2}) == "training=null, training.micro_batch_size=2"
