"""Test helpers shipped with the library: fault injection and the fault soak."""
