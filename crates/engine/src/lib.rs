//! The keel engine: agent loop, sessions, checkpoints, dialogs, sub-agent orchestration.
