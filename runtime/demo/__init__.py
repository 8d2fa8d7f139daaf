"""The built-in demo job: a tiny model and a verifiable task, selected when no --prompt-data is given."""
