"""Several hosts on one machine (network namespaces) for tests and replays."""
