"""The KV (chunkattn_server.kv): the block pool, the retention rule's memory bound, fork, truncate, export and
import, a float8 cache and its scales."""
