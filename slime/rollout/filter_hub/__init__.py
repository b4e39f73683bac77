"""Dynamic-sampling filters (`--dynamic-sampling-filter-path`), named as in upstream slime."""
