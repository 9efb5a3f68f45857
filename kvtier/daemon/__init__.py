"""The kvtier service: config, wire protocol, unix-socket server, sd_notify, metrics, supervision, gpu + store backend."""
