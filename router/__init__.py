"""The Ray Serve ingress (OpenAI-compatible API, admission, routing); see the serving issue."""
