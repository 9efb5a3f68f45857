"""The geometry of a load's native-AIO reads: how much is in flight at once, and the piece a large read is cut into.

The batch pipeline (`packed.PackedLoad`) cuts a payload read straight into its target into pieces of AIO_PIECE_BYTES
and sends such reads while fewer than AIO_WINDOW_BYTES are in flight; `span_read.SpanReader` and the benchmarks' fio
bound (`bench/fio_limit.py`) read with the same geometry.
"""

# Bytes in flight at once, and the piece a run's read is cut into (into huge-page pool memory a piece goes to the
# disk in requests of up to max_sectors_kb: kvtier.core.hugepages). Smaller pieces in a smaller window keep more
# requests in flight for the same bytes: DSV4 restores in batches read faster so, and one large load no slower
# (bench/restore.py and bench/peers.py measure both).
AIO_WINDOW_BYTES = 32 << 20
AIO_PIECE_BYTES = 2 << 20
