"""The plugin host: the hook contract, the plugin manager and the one-at-a-time call loop."""
