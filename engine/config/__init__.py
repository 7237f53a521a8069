"""A run's config and its validation: the typed config (schema), the rules that refuse a bad config in one line naming field, value and rule (pure: they take values), the thin reader of the files a config names (validate_files), Hugging Face config fields and placements.

May import engine.mesh, engine.errors, engine.peaks and profilers/; the rest of the engine imports it."""
