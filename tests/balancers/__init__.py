"""Tests of balancers/: the policies, their Redis forms, plugins."""
