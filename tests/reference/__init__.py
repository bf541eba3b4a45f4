"""Independent reference implementations that parity tests compare trtmoe against."""
