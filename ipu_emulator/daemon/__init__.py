"""The daemon: one process that owns a pool of IPU processes and lends them to
hosts over a Unix socket (``server``), its wire format (``protocol``), the
pool (``_pool``) and its Prometheus endpoint (``_metrics``)."""
