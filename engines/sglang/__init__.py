"""The SGLang engine adapter: its server's arguments, protocol record and weight updates."""
