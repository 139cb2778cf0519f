"""What a step hands back: the requests' book, with each request's input as token ids and its reply's
text (requests), and the StepRecord and its events (records)."""
