// Package content holds the types every part of weightd speaks in, with no
// dependency on any of them: blob descriptors and digest checks, the range
// reader role every source and peer plays, models as named sets of files,
// and the sentinel errors of stores and sources. A package that only needs
// to name a blob or a model, or to classify an error, imports this one
// instead of the cache or the prefetch pipeline.
package content
