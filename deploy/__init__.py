"""Deployment: the Ray Serve application, its config, the command line, the metrics
(Prometheus rules and Grafana dashboard beside them), and (later) the batch job."""
