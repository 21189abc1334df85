package warmpool_test

import (
	"fmt"

	"github.com/weightd/weightd/pkg/warmpool"
	"github.com/weightd/weightd/pkg/warmpool/engine"
)

// An adapter asked for without a name is served under one derived from its
// reference: valid as a runtime model name and as a directory name.
func ExampleAdapterName() {
	name := warmpool.AdapterName("hf://acme/sql-lora@main")
	fmt.Println(name[:len(name)-8], engine.ValidAdapterName(name))
	// Output: sql-lora- true
}
