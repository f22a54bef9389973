"""What sparse decode offload reports: Prometheus counters, the summary log line, and
recorded top-k traces."""
