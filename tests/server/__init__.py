"""The server's top-level modules (chunkattn_server's config, flags, malloc) and its layers' import rules."""
