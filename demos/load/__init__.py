"""A room of students against a live server: one burst (room) and a long soak (soak)."""
