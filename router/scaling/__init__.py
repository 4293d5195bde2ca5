"""Scale from zero: each declared model's demand (this process's, or summed over replicas in
Redis) and the KEDA external scaler that serves it (docs/scale-from-zero.md)."""
