"""ftc10d inside other people's trainers (``ftc10d.integrations.torchtitan``)."""
