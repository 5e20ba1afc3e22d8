"""HTTP: the versioned REST routes, tokens, request limits and the one place errors become answers."""
