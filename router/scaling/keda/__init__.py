"""KEDA's external scaler protocol: the vendored `externalscaler.proto` (Apache-2.0, its header
says whence) and the modules grpcio-tools generates from it, committed (`make keda-proto`
regenerates them; tests/scaling/test_keda_proto.py fails when they are stale)."""
