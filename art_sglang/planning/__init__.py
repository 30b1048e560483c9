"""Planning: from what the user asked to the frozen serving plan (devices, GPU memory); nothing here runs."""
