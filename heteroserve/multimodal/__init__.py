"""Images for vision-language models: fetching and decoding them, and turning them into model inputs."""
