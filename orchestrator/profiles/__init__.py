"""Engine profiles: measured step times on a device, and the cost model that reads them."""
