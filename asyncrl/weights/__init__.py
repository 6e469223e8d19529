"""Weight sync: buckets, standalone update groups, the learner-side sender."""
