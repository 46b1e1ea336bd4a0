"""The domain layer: sandbox records, their state machine and the orchestrator."""
