"""Deployment: the application (in process or on Ray Serve), its config, the command line,
the batch job, the Prometheus rules and Grafana dashboard, and the simulator's commands."""
