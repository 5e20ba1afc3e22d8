"""What a person looks at: the read client for a collector's REST API and the terminal
views built on it (``stepwatch top``, the live view of ``stepwatch demo``).

The views read only the public API (``/api/v1``), so they work against any collector,
local or remote, and show optional parts (time breakdown, events, progress) when the
collector serves them and say so when it does not.
"""
