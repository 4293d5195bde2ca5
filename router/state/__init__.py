"""What is shared through Redis: one "store that may degrade" base, its pipeliner, one client."""
