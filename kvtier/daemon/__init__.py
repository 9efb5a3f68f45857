"""The kvtier service: unix-socket server, sd_notify, metrics, verifier supervision, gpu + store backend."""
