"""Agent rollouts (upstream slime's `slime.agent`): protocol adapters a coding agent's CLI talks to
(adapters), model-output parsing (parsing), the per-session trajectory -> training samples
(trajectory), sandboxes that run commands (sandbox: `LocalSandbox` here, `E2BSandbox` for E2B) and the
CLI harnesses (harness)."""
