// Package cache is weightd's content-addressed store on local disk.
//
// Layout under the root directory:
//
//	blobs/sha256/<hex>   complete, verified, read-only blob files
//	partial/<hex>.data   pre-allocated file of a blob being downloaded
//	partial/<hex>.state  its persisted progress: verified prefix, chunk map, hash state
//	models/              models materialised as links into blobs/, in the
//	                     Hugging Face hub cache layout
//	                     (models--org--name/snapshots/<rev>/<path>, and
//	                     models--org--name/refs/<branch> holding <rev>; a
//	                     name of three parts, a/b/c, is models--a--b--c)
//	index.db             sizes, last access, pins and chunk maps (bbolt)
//
// Every blob is written to partial/, fsynced, checked against its size and
// sha256, renamed into blobs/ and the directory fsynced: nothing unverified is
// ever visible under blobs/ or readable through the Store. One download runs
// per blob however many callers ask for it; an interrupted download resumes
// from its last verified chunk, in this process or after a restart.
package cache
