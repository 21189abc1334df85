// Package s3 resolves s3:// references with the AWS SDK, against AWS S3 or
// an S3-compatible store: one object pinned by digest, a prefix with a
// model.json (httpsource.Manifest), or a prefix whose objects carry
// full-object SHA-256 checksums. Objects are read with ranged GetObject.
//
// Authentication: the agent's credentials (LoadCredentials: the SDK's
// default chain, IMDS only when allowed) for the operator, and for a pod
// only where source.AgentCredentials names the bucket and its namespace;
// every other request is anonymous.
//
// Permanent: 4xx other than 408, 425 and 429 (404 a missing object, 416 a
// size mismatch), a bad model.json, and objects without a sha256
// (ErrUnverifiable).
package s3
