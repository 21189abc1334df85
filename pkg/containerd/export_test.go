package containerd

// DialOpts are the importer's options for its containerd client.
var DialOpts = dialOpts
