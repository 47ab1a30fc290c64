"""Tasks: data + per-agent prompts + how outputs combine + reward + feedback. Imports nothing of ours."""
