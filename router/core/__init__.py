"""The bottom layer: settings, the Backend value type, the project's errors.

Imports nothing else of the project.
"""
