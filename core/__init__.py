"""The kernel every app uses, without models (docs/design.md#layout)."""
