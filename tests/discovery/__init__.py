"""Tests of router/discovery/: Kubernetes and DNS sources, the reconciler."""
