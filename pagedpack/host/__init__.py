"""What the host offers: device types and child processes."""
