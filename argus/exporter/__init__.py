"""The Prometheus exporter: `argus export-prometheus` and its text exposition."""
