"""The HTTP face: OpenAI-compatible routes and who may call them."""
