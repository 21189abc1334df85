package testbed_test

import (
	"context"
	"fmt"
	"log"

	"github.com/weightd/weightd/internal/testbed"
)

// Two hosts on links of 100 Mbit/s each way; the second one runs a program
// that reaches the first.
func Example() {
	ctx := context.Background()
	tb, err := testbed.New(ctx, testbed.Config{Hosts: 2, LinkMbit: 100})
	if err != nil {
		log.Fatal(err)
	}
	defer tb.Close()
	h := tb.Hosts()
	out, err := h[1].Command(ctx, "ip", "route", "get", h[0].Addr.String()).CombinedOutput()
	if err != nil {
		log.Fatal(err)
	}
	fmt.Printf("%s", out)
}
