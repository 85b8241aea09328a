"""Cost models: how long an op takes on a given device state."""
