"""longctx: long-context inference engine."""
