"""The pages: the Gradio lecturer page, its chat sessions and lessons, the strings, the student and
projector pages, the chart-only page (no gradio), the arena leaderboard, and the static assets."""
