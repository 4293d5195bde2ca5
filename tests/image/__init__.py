"""`make image-test`: build the container image and run it (see run.py)."""
