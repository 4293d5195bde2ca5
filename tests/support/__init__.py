"""The suite's harness (processes on loopback ports), its fakes and the one `wait_for`."""
