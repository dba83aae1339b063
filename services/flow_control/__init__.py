"""flow_control: admission control for inference requests (one gRPC stream per request)."""
