"""The `llmgw` command: `llmgw ctl` talks to the control plane's REST API; it imports no Django."""
