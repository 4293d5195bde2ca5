"""What tests share beside the harness: the manual clock (`clock.py`)."""
