"""The suite's harness (processes on loopback ports), its fakes, the manual clock and the one
`wait_for`."""
